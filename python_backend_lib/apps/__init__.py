"""The server's programs: the Triton launcher and `whisper-triton serve` (`cli`). The
gateway and the `whisper-triton` command are packages of their own above this library."""
