"""Checkpoint sources to a `ModelConfig` and a state dict with Hugging Face parameter
names: `weights` chooses among the formats, one module each (`packaged`,
`hf_folder`, `ctranslate2_folder`, `random_weights`)."""
