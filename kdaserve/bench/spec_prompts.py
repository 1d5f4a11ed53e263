"""Prompts for `kdaserve bench spec` that the demo model and its draft never trained on.

Two kinds, as users meet them: modern prose (no Shakespeare at all), and a held-out play of the
demo corpus. The demo model's training split excludes its held-out plays (train/corpus.py,
`split_documents`), and `extract-hidden --corpus shakespeare` leaves out RESERVED_DOCUMENTS, so
neither the target nor the draft saw any of this text.
"""

from __future__ import annotations

# held-out plays the draft's training data leaves out, kept for this benchmark
RESERVED_DOCUMENTS = ("timon_of_athens",)

MODERN_PROSE = [
    "The weather today is",
    "My favourite way to spend a Sunday morning is",
    "The new train line opened last week, and commuters say",
    "To install the package, first open a terminal and",
    "She looked at her phone and realised the meeting",
    "The best advice I ever got about writing was",
    "Scientists announced on Tuesday that the telescope had",
    "When the power went out, the whole neighbourhood",
]

# Timon of Athens (held out): the opening lines of speeches, speaker and all
HELDOUT_PLAY = [
    "PAINTER:\nHow shall I understand you?\n\nPOET:\nI will unbolt to you.",
    "POET:\nSir, I have upon a high and pleasant hill\nFeign'd Fortune to be thron'd:",
    "PAINTER:\n'Tis common:\nA thousand moral paintings I can show",
    "FIRST LORD:\nI am sick of that grief too, as I understand how all things go.",
    "TIMON:\nWith all my heart, gentlemen both; And how fare you?",
    "SECOND LORD:\nMy most honourable lord, I am e'en sick of shame, that",
    "TIMON:\nThink not on't, sir.\n\nSECOND LORD:\nIf you had sent but two hours before,--",
    "FIRST LORD:\nRoyal cheer, I warrant you.\n\nTHIRD LORD:\n",
]


def unseen_prompts() -> list[str]:
    """Prose and play prompts interleaved, so that any prefix of the list mixes both kinds."""
    return [p for pair in zip(MODERN_PROSE, HELDOUT_PLAY) for p in pair]


def long_prompt_ids(encode, num_tokens: int, index: int) -> list[int]:
    """A prompt of exactly `num_tokens` tokens that ends with unseen prompt `index`: the
    unseen prompts, cycled from the next one on, fill the context before it. The filler
    repeats (there is not 64k tokens of held-out text here), so these rows measure what a
    long context costs the drafter and the verifier, not acceptance on fresh text."""
    prompts = unseen_prompts()
    tail = encode(prompts[index % len(prompts)])[-num_tokens:]
    order = prompts[index + 1:] + prompts[:index + 1]
    filler = encode("\n\n".join(order) + "\n\n")
    need = num_tokens - len(tail)
    ids = (filler * (need // max(1, len(filler)) + 1))[:need]
    return ids + tail
