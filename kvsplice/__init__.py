"""kvsplice: an LLM inference engine that reuses KV cache beyond prefixes."""
