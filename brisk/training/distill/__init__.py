"""Distillation: a smaller student of the served model, built from its own layers and trained to
follow its next-token distribution. The student is an ordinary checkpoint folder: it serves,
and drafts for speculative decoding, with the teacher's tokenizer by construction."""
