"""Everything from files to global batches.

Made once, before training (torch-free: it needs no accelerator and no training stack):
    tokenizers.py, byte_tokenizer.py   the byte tokenizer, or a byte-level BPE from a local
                     tokenizer.json (`longrun tokenizer train`)
    prepare.py, sources.py, encoding.py, shards.py, verification.py, out_lock.py
                     `longrun data prepare`: text, jsonl and parquet tokenised into memory-mapped
                     token shards, verified, and their reader

Read while training:
    corpus.py        Corpus: documents as chunks of at most max_seq_len (BOS/EOS)
    documents.py     the corpora (synthetic, files) and the resumable global sampler
    jsonl_corpus.py  a .jsonl file, read line by line as chunks are drawn
    token_corpus.py, mixture.py   prepared token shards; a weighted, resumable mixture of them
    index_cache.py, index_file.py, orders.py   indexes of one entry per document (offsets,
                     lengths, chunk tables, each epoch's order) built once by the first process
                     and memory-mapped by the others
    packing.py       documents packed into global batches and micro-batches under a token budget,
                     and the prefetch thread

The trainer's `feed.py` turns each global batch into this rank's share of it. The package's
own import loads nothing, so `longrun data prepare` never pays for torch.
"""
