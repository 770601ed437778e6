"""What admission answers: the verdicts (`Forward`, `Passthrough`, `Hold`, `Refusal`), every refusal built
in one place, and the `x-ratelimit-*` / `retry-after` headers.
"""
