"""Checkpoint sources (packaged, Hugging Face folder, CTranslate2 folder, random) to a
`ModelConfig` and a state dict with Hugging Face parameter names."""
