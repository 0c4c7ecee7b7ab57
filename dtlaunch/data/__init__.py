"""Corpus preparation: tokenizers and the tokenize-to-shards step (numpy only; no torch)."""
