"""Code the test modules share (corpora, tiny models, run helpers, process harnesses). Test modules import from
here and never from one another, so each test module can be read, run and changed alone."""
