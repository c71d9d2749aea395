"""Measured workloads shared by `kvconnect demo` and `kvconnect bench`: a two-process P/D pull with
every byte checked (`pull`) and the raw-backend baseline moving the same bytes (`raw`)."""
