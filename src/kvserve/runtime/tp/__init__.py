"""kvserve.runtime.tp: tensor parallelism, one process per rank: launch, rank workers,
collectives and their fault checks."""
