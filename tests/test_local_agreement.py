"""LocalAgreement-2 (apps.local_agreement): words are committed once two consecutive
hypotheses agree on them, and never taken back."""

from __future__ import annotations

from python_backend_lib.apps.local_agreement import LocalAgreement, common_prefix, delta_text, words_of


def test_a_word_is_committed_when_two_hypotheses_in_a_row_agree_on_it():
    agreement = LocalAgreement()
    assert agreement.insert(words_of("And so")) == []  # nothing to agree with yet
    assert agreement.insert(words_of("And so my fellow")) == ["And", "so"]
    assert agreement.insert(words_of("And so my fellow Americans,")) == ["my", "fellow"]
    assert agreement.committed == ["And", "so", "my", "fellow"]


def test_a_rewritten_ending_is_held_back_until_it_settles():
    agreement = LocalAgreement()
    agreement.insert(words_of("ask not what"))
    assert agreement.insert(words_of("ask knot what your")) == ["ask"]
    assert agreement.insert(words_of("ask not what your country")) == []  # "not" against "knot"
    assert agreement.insert(words_of("ask not what your country can")) == ["not", "what", "your", "country"]
    assert agreement.committed == words_of("ask not what your country")


def test_committed_words_are_never_taken_back_when_a_hypothesis_changes_them():
    agreement = LocalAgreement()
    agreement.insert(["One", "two"])
    agreement.insert(["One", "two", "three"])
    assert agreement.committed == ["One", "two"]
    # The model changes its mind about a committed word: what was sent stays, and the
    # tail past as many words as are committed is what is compared from then on.
    assert agreement.insert(["Won", "two", "three", "four"]) == ["three"]
    assert agreement.committed == ["One", "two", "three"]


def test_finish_commits_the_final_transcript_past_what_was_committed():
    agreement = LocalAgreement()
    agreement.insert(words_of("he was not"))
    agreement.insert(words_of("he was not an ill"))
    assert agreement.finish(words_of("he was not an ill disposed young man")) == words_of("an ill disposed young man")
    assert agreement.committed == words_of("he was not an ill disposed young man")
    assert agreement.finish(words_of("he was not an ill disposed young man")) == []


def test_deltas_joined_make_the_transcript():
    agreement = LocalAgreement()
    deltas = []
    for hypothesis in ["Ten", "Ten of", "Ten of clubs", "Ten of clubs."]:
        words = agreement.insert(words_of(hypothesis))
        if words:
            deltas.append(delta_text(words, first=len(agreement.committed) == len(words)))
    words = agreement.finish(words_of("Ten of clubs."))
    deltas.append(delta_text(words, first=False))
    assert deltas == ["Ten", " of", " clubs."]
    assert "".join(deltas) == "Ten of clubs."


def test_common_prefix():
    assert common_prefix(["a", "b", "c"], ["a", "b", "d"]) == ["a", "b"]
    assert common_prefix([], ["a"]) == []
    assert common_prefix(["a"], ["a", "b"]) == ["a"]
