"""An example user reward function for `task.name=file`: 1.0 for the exact answer, partial credit otherwise."""


def score(prompt: str, response: str, answer: str | None) -> float:
    if answer is None:
        return 0.0
    if response == answer:
        return 1.0
    matched = sum(a == b for a, b in zip(response, answer))
    return 0.5 * matched / max(len(response), len(answer), 1)
