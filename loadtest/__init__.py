"""Load tests for a running whisper-triton server: locust users and a bounded headless runner."""
