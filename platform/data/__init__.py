"""Real data in: tokenizers (the byte tokenizer, or a local BPE `tokenizer.json`), `longrun data
prepare` (text, jsonl and parquet tokenised into memory-mapped token shards), and the shards'
reader. Torch-free: preparing data needs no accelerator and no training stack.
"""
