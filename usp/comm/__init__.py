"""Communication: Ulysses all-to-all, the ring exchange, counted collectives."""
