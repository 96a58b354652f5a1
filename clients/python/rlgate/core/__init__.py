"""What both sides of the contract share: the client and the services import it, and it imports neither.

- `backoff`: the one exponential-backoff-with-jitter schedule every retry loop draws its delays from.
- `convert`: exact JSON text and protobuf Structs, both ways (tool arguments and results, recorded requests).
- `errors`: the one error hierarchy, and how an error becomes a `google.rpc.Status` and back.
- `redact`: URLs shown without what may carry a credential (error messages, logs, spans).
"""
