"""Small helpers with no project vocabulary: files, digests, JSONL."""
