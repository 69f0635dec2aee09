"""The data pipeline: documents, tokenizers, packed rows, SFT conversations, synthetic tasks, bad rows."""
