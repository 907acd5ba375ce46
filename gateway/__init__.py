"""The OpenAI-compatible gateway in front of a whisper-triton server: OpenAI's audio
API over HTTP (`app`, `openai_api`, `openai_errors`, `transcript_events`), its
Realtime live transcription sessions (`realtime` and the modules it runs), the page
at / (`page/`), and `whisper-triton gateway` in one process or several (`cli`,
`workers`). It talks to Triton as a client (`triton_calls`, over `clients`)."""
