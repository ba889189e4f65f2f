"""APO: prompt optimisation by critique, rewrite and measured reward."""
