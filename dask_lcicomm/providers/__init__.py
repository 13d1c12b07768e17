"""Fabric providers: one backend per fabric behind the narrow :class:`Device` interface."""
