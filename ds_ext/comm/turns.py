"""Turns between the two halves of an interleaved F&B chunk (ds_ext/pipe/overlap.py
runs them): a half that has issued an asynchronous collective calls ``switch`` to hand
the baton to the other half; state the halves must not share is ``PerThread``. Kept
apart from the interleaver so that communication code (ds_ext/comm/alltoall.py) can
switch without importing the pipeline."""

import threading

_local = threading.local()
_MISSING = object()


def switch():
    """Hand the baton to the other half of the running F&B chunk, if there is one and it
    has not finished, and return when it is handed back. A no-op outside an interleave."""
    ctx = getattr(_local, "ctx", None)
    if ctx is not None:
        ctx[0]._yield(ctx[1])


def interleaving():
    """True on a thread that runs one half of an interleaved F&B chunk."""
    return getattr(_local, "ctx", None) is not None


class PerThread:
    """Data descriptor: one value per interleave half while a chunk is interleaved, the
    shared value otherwise (and as each half's starting value)."""

    def __set_name__(self, owner, name):
        self.name, self.key = name, "_shared_" + name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        values = getattr(_local, "values", None)
        if values is not None:
            value = values.get((id(obj), self.name), _MISSING)
            if value is not _MISSING:
                return value
        try:
            return obj.__dict__[self.key]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj, value):
        values = getattr(_local, "values", None)
        if values is not None:
            values[(id(obj), self.name)] = value
        else:
            obj.__dict__[self.key] = value
