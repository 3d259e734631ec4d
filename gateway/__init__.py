"""The gateway process: gRPC front end, queues and dispatch. Never imports torch or the worker package."""
