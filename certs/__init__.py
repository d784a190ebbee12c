"""Development PKI for the admission webhook (`python -m certs.make`); see certs/make.py."""
