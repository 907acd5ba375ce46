"""The `whisper-triton` command line, above the packages whose commands it joins:
the server's (`python_backend_lib`), the clients' and the gateway's."""
