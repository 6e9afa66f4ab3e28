"""Weights in and out of longrun: what people outside it load, and what longrun loads of theirs.

    weights_file.py  what every export shares: its result, its errors, safetensors' rules
    export.py        `longrun checkpoint export`: one safetensors or torch file, or (hf) a directory
    hf.py            longrun's decoder as Hugging Face's `LlamaForCausalLM`: names and config.json
    hf_export.py     a checkpoint as a Hugging Face model directory (weights, config, tokenizer)
    hf_import.py     a local Hugging Face Llama directory as longrun weights (`model.init_from`)

Checkpoints themselves (writing, committing, restoring at any layout) are `longrun.checkpoint`;
this package only reads them, through its catalog.
"""
