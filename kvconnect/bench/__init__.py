"""Benchmarks behind `kvconnect bench`: each prints kvconnect beside a baseline measured in the same run."""
