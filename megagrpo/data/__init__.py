"""Dataset readers, prompt templates and the embedded synthetic task."""
