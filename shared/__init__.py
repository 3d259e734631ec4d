"""Code shared by the gateway and the workers: configuration, sampling parameters, IPC. No torch, no grpc."""
