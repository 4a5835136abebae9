"""Decoding: draft trees and the context-lookup branch (tree), verification and lossless acceptance (sampling),
the never-slower-than-AR guard, the decoder that runs rounds (decoder), and the session that assembles one from
user-facing names (session). Above model/ and heads/; a tuner is attached from above, never imported."""
