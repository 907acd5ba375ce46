"""Text out: token ids to text and timed segments (`tokenizer`), and a finished
transcript to its response formats (`formats`: text, json, verbose_json, srt, vtt, tsv;
subtitle cues in `subtitles`)."""
