"""The Dask side of lci://: comm, listener, connector and the registered backend."""
