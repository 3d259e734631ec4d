"""A worker: the engine (scheduler, block manager, model runner) that owns one model. Never imports gateway or grpc."""
