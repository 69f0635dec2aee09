"""How big the Engram tables are: each layer's table is its (n-gram size, head) buckets laid end to end, each
bucket a prime number of rows. Plain arithmetic on ``model.config.EngramArgs`` (``args``), below both the config
(which checks ``model.engram.num_embeddings`` against it) and the model (``model/engram.py``)."""
import sympy


def bucket_primes(vocab_size: int, count: int) -> list[int]:
    """The primes the reference draws for ``count`` (layer, n-gram size, head) buckets in turn: each the next
    unused prime after ``vocab_size - 1``. Every search starts there and skips the primes drawn before, so the
    k-th draw is the k-th prime >= ``vocab_size``: one ``nextprime`` step each instead of a search from the start."""
    primes, prime = [], vocab_size - 1
    for _ in range(count):
        prime = sympy.nextprime(prime)
        primes.append(prime)
    return primes


def table_rows(args) -> tuple[int, ...]:
    """Rows of every Engram layer's table (``args.layers`` order): the sum of its buckets' primes."""
    per_layer = (args.max_ngram_size - 1) * args.n_heads
    return tuple(layer_rows(args, bucket_primes(args.vocab_size, len(args.layers) * per_layer)))


def layer_rows(args, primes: list[int]) -> list[int]:
    """Rows of each Engram layer's table from the primes of all its buckets, drawn in order."""
    per_layer = (args.max_ngram_size - 1) * args.n_heads
    return [sum(primes[i * per_layer:(i + 1) * per_layer]) for i in range(len(args.layers))]  # ints: also on meta
