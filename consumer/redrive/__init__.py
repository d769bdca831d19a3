"""Dead-letter re-drive: `ticdc-consumer dead-letters list|replay` (see `consumer.redrive.replay`)."""

from consumer.redrive.replay import LetterState, ReplayReport, letter_states, replay

__all__ = ["LetterState", "ReplayReport", "letter_states", "replay"]
