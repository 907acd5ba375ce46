"""Whisper's language codes and their English names.

The codes are those of `weights.LANGUAGES` (ISO 639-1, plus "haw" and "yue",
and Whisper's "jw" for Javanese). OpenAI's verbose_json reports a language by
its lower-case English name ("english"); requests name it by code ("en").
"""

from __future__ import annotations

LANGUAGE_NAMES: dict[str, str] = {
    "af": "afrikaans", "am": "amharic", "ar": "arabic", "as": "assamese", "az": "azerbaijani",
    "ba": "bashkir", "be": "belarusian", "bg": "bulgarian", "bn": "bengali", "bo": "tibetan",
    "br": "breton", "bs": "bosnian", "ca": "catalan", "cs": "czech", "cy": "welsh",
    "da": "danish", "de": "german", "el": "greek", "en": "english", "es": "spanish",
    "et": "estonian", "eu": "basque", "fa": "persian", "fi": "finnish", "fo": "faroese",
    "fr": "french", "gl": "galician", "gu": "gujarati", "ha": "hausa", "haw": "hawaiian",
    "he": "hebrew", "hi": "hindi", "hr": "croatian", "ht": "haitian creole", "hu": "hungarian",
    "hy": "armenian", "id": "indonesian", "is": "icelandic", "it": "italian", "ja": "japanese",
    "jw": "javanese", "ka": "georgian", "kk": "kazakh", "km": "khmer", "kn": "kannada",
    "ko": "korean", "la": "latin", "lb": "luxembourgish", "ln": "lingala", "lo": "lao",
    "lt": "lithuanian", "lv": "latvian", "mg": "malagasy", "mi": "maori", "mk": "macedonian",
    "ml": "malayalam", "mn": "mongolian", "mr": "marathi", "ms": "malay", "mt": "maltese",
    "my": "burmese", "ne": "nepali", "nl": "dutch", "nn": "norwegian nynorsk", "no": "norwegian",
    "oc": "occitan", "pa": "punjabi", "pl": "polish", "ps": "pashto", "pt": "portuguese",
    "ro": "romanian", "ru": "russian", "sa": "sanskrit", "sd": "sindhi", "si": "sinhala",
    "sk": "slovak", "sl": "slovenian", "sn": "shona", "so": "somali", "sq": "albanian",
    "sr": "serbian", "su": "sundanese", "sv": "swedish", "sw": "swahili", "ta": "tamil",
    "te": "telugu", "tg": "tajik", "th": "thai", "tk": "turkmen", "tl": "tagalog",
    "tr": "turkish", "tt": "tatar", "uk": "ukrainian", "ur": "urdu", "uz": "uzbek",
    "vi": "vietnamese", "yi": "yiddish", "yo": "yoruba", "yue": "cantonese", "zh": "chinese",
}
_CODES = {name: code for code, name in LANGUAGE_NAMES.items()}


def language_name(code: str) -> str:
    """"en" -> "english"; ValueError for a code Whisper does not know."""
    try:
        return LANGUAGE_NAMES[code]
    except KeyError:
        raise ValueError(f"unknown language code {code!r}") from None


def language_code(name: str) -> str:
    """"english" -> "en" (the inverse of `language_name`)."""
    try:
        return _CODES[name]
    except KeyError:
        raise ValueError(f"unknown language name {name!r}") from None
