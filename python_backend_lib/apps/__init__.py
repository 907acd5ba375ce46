"""The programs: `whisper-triton serve` (the Triton launcher), `gateway` (the
OpenAI-compatible HTTP service) and the command line that starts them."""
