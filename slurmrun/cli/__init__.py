"""The ``slurmrun`` command: script mode, ``info`` and dry runs."""
