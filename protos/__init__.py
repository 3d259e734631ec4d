"""Generated protobuf modules for the public API and the gateway<->worker wire (arrives with the cluster)."""
