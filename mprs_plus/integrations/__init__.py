"""Where other libraries rebuild the loader: one module per library, imported only when
asked for (``import mprs_plus.integrations.accelerate``), so that nothing else in the
package imports a trainer.

    accelerate    Hugging Face Accelerate, and so Transformers' ``Trainer``: ``enable()``
    lightning     Lightning: ``StatsLogger``, a callback that logs the loader's figures

Each checks the library's version and fails with an error saying what to do when that
library's internals moved, never falling back silently to torch's loader.
"""
