"""Whisper's languages: their codes in token order, and their English names.

One table: the i-th code's token follows <|startoftranscript|> + 1 + i
(`model_facts.SpecialTokens`), and OpenAI's verbose_json reports a language by
its lower-case English name ("english"), where requests name it by code ("en").
The codes are ISO 639-1, plus "haw" and "yue", and Whisper's "jw" for Javanese.
The names are openai-whisper's, except two that follow ISO 639's English names:
"burmese" (openai-whisper: "myanmar") and "norwegian nynorsk" ("nynorsk").
"""

from __future__ import annotations

# Code -> name, in Whisper's token order (large-v3 added "yue", the 100th).
LANGUAGE_NAMES: dict[str, str] = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian", "ko": "korean",
    "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish", "pl": "polish", "ca": "catalan",
    "nl": "dutch", "ar": "arabic", "sv": "swedish", "it": "italian", "id": "indonesian", "hi": "hindi",
    "fi": "finnish", "vi": "vietnamese", "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay",
    "cs": "czech", "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian", "la": "latin",
    "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak", "te": "telugu", "fa": "persian",
    "lv": "latvian", "bn": "bengali", "sr": "serbian", "az": "azerbaijani", "sl": "slovenian", "kn": "kannada",
    "et": "estonian", "mk": "macedonian", "br": "breton", "eu": "basque", "is": "icelandic", "hy": "armenian",
    "ne": "nepali", "mn": "mongolian", "bs": "bosnian", "kk": "kazakh", "sq": "albanian", "sw": "swahili",
    "gl": "galician", "mr": "marathi", "pa": "punjabi", "si": "sinhala", "km": "khmer", "sn": "shona",
    "yo": "yoruba", "so": "somali", "af": "afrikaans", "oc": "occitan", "ka": "georgian", "be": "belarusian",
    "tg": "tajik", "sd": "sindhi", "gu": "gujarati", "am": "amharic", "yi": "yiddish", "lo": "lao", "uz": "uzbek",
    "fo": "faroese", "ht": "haitian creole", "ps": "pashto", "tk": "turkmen", "nn": "norwegian nynorsk",
    "mt": "maltese", "sa": "sanskrit", "lb": "luxembourgish", "my": "burmese", "bo": "tibetan", "tl": "tagalog",
    "mg": "malagasy", "as": "assamese", "tt": "tatar", "haw": "hawaiian", "ln": "lingala", "ha": "hausa",
    "ba": "bashkir", "jw": "javanese", "su": "sundanese", "yue": "cantonese",
}
LANGUAGE_CODES: tuple[str, ...] = tuple(LANGUAGE_NAMES)
_CODES_BY_NAME = {name: code for code, name in LANGUAGE_NAMES.items()}
# Other English names a request may give: openai-whisper's own spellings of the two
# above, and the other names it accepts for a language.
LANGUAGE_ALIASES: dict[str, str] = {
    "myanmar": "my", "nynorsk": "nn", "valencian": "ca", "flemish": "nl", "haitian": "ht", "letzeburgesch": "lb",
    "pushto": "ps", "panjabi": "pa", "moldavian": "ro", "moldovan": "ro", "sinhalese": "si", "castilian": "es",
    "mandarin": "zh",
}


def language_name(code: str) -> str:
    """"en" -> "english"; ValueError for a code Whisper does not know."""
    try:
        return LANGUAGE_NAMES[code]
    except KeyError:
        raise ValueError(f"unknown language code {code!r}") from None


def requested_language(text: str) -> str:
    """A language as a request or a command line may name it, as its code: "en",
    "EN", "English", "english" -> "en"; "Myanmar" -> "my". Text that names no
    language comes back lower-cased, for the checkpoint to refuse."""
    key = " ".join(text.lower().split())
    if key in LANGUAGE_NAMES:
        return key
    return _CODES_BY_NAME.get(key) or LANGUAGE_ALIASES.get(key) or key


def language_code(name: str) -> str:
    """"english" -> "en" (the inverse of `language_name`)."""
    try:
        return _CODES_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown language name {name!r}") from None

