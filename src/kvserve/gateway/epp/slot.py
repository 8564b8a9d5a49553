"""One admitted request's hold on an admission slot: told when the answer started or the
client left before it, and released exactly once (`release` is idempotent). The shape of
`admission.admit`, over `Admission.acquire`'s generation."""

from __future__ import annotations

import time

from kvserve.gateway.admission import Admission


class Slot:
    """Held from admission until the response ends; `with slot:` releases it too."""

    def __init__(self, admission: Admission, generation: int) -> None:
        self.admission = admission
        self.generation = generation
        self.admitted = time.monotonic()
        self.released = False

    def first_byte(self, late: bool, answer_s: float | None) -> None:
        self.admission.first_byte(self.generation, late, answer_s)

    def gave_up(self, waited_s: float | None) -> None:
        if not self.released:  # it must still count in flight
            self.admission.gave_up(self.generation, waited_s)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.release()

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


async def admit(admission: Admission, deadline: float | None = None, since: float | None = None,
                refuse_on_arrival: bool = True) -> Slot:
    """A slot; raises admission.Saturated when none comes within the queue limits."""
    return Slot(admission, await admission.acquire(deadline, since, refuse_on_arrival))
