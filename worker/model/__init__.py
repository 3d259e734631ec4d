"""Our own PyTorch transformer for the Llama family, configured and loaded from a Hugging Face folder. Knows nothing of requests or schedulers."""
