"""Operator tools: the ``mtc`` command line (``cli``), ``mtc backups`` (``backups``) and
``mtc render`` (``render``). Beside ``node`` at the top of the product; plug-in commands
(the demo) come in through the ``mtc.commands`` entry point, never by import."""
