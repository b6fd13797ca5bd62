"""`llmpipe validate`: accuracy of a build against the float32 Hugging Face reference of its checkpoint."""
