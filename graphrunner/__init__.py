"""graphrunner: an LLM model runner built for CUDA graphs."""
