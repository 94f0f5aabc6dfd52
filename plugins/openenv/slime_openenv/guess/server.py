"""A small multi-turn OpenEnv environment, served as OpenEnv serves any: ``create_app(...)`` gives the FastAPI app
(``/ws`` sessions, ``/reset``, ``/step``, ``/schema``, ``/health``) that ``uvicorn slime_openenv.guess.server:app``
runs, in a container or, as the plugin does, as a process on 127.0.0.1.

The secret is drawn from the reset seed, so every sample of one prompt group plays the same game. Each step reads
the first integer of ``message``: "higher" / "lower" until it is right (reward 1, done) or ``MAX_GUESSES`` have
been made (reward 0, done). A reply without a number costs a guess.
"""

from __future__ import annotations

import random
import re
import uuid
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State, create_app

LOW, HIGH, MAX_GUESSES = 1, 16, 4


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str


def secret_for(seed: int) -> int:
    """The secret number of the game reset with ``seed``."""
    return random.Random(seed).randint(LOW, HIGH)


def first_integer(text: str) -> int | None:
    match = re.search(r"-?\d+", text)
    return int(match.group()) if match else None


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per WebSocket session, no shared state

    def __init__(self):
        super().__init__()
        self._state, self._secret = State(), None

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        self._secret = secret_for(seed if seed is not None else random.randrange(1 << 30))
        return GuessObservation(text=f"I picked a whole number from {LOW} to {HIGH}. Guess it: reply with one "
                                     f"number. You have {MAX_GUESSES} guesses.")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        if self._secret is None:
            raise RuntimeError("step before reset")
        self._state.step_count += 1
        guess, left = first_integer(action.message), MAX_GUESSES - self._state.step_count
        if guess == self._secret:
            return GuessObservation(text=f"Correct, it is {guess}.", reward=1.0, done=True)
        hint = "That is not a number." if guess is None else ("Higher." if guess < self._secret else "Lower.")
        if left <= 0:
            return GuessObservation(text=f"{hint} No guesses left; it was {self._secret}.", reward=0.0, done=True)
        return GuessObservation(text=f"{hint} {left} guesses left.", reward=0.0, done=False)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=256)
