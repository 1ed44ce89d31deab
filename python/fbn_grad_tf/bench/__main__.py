"""``python -m fbn_grad_tf.bench``: the benchmark's command line (see fbn_grad_tf.bench)."""
import sys

from . import main

sys.exit(main())
