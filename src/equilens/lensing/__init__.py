"""Lensing quantities of any mass model: ray shooting, magnification, critical curves."""

from ._critical import caustics as caustics, critical_curves as critical_curves
