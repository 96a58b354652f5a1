"""What both sides of the contract share: the client and the services import it, and it imports neither.

- `backoff`: the one exponential-backoff-with-jitter schedule every retry loop draws its delays from.
"""
