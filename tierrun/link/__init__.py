"""The front-end <-> core link: framed, batched, authenticated."""
