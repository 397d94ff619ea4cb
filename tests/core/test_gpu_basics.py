"""The core on a real GPU: the driver loads, the devices match torch's view, the limit probes are sane."""
import pytest

from ebbtide import _native

pytestmark = pytest.mark.gpu


def test_driver_found_and_devices_match_torch():
    import torch

    C = _native.load()
    st, why = C.driver_status()
    assert st == 0, why
    assert C.device_count() == torch.cuda.device_count()
    assert C.driver_version() >= 12000


def test_limit_probes_on_the_gpu():
    from ebbtide.bench.limits import Limits

    lim = Limits(quick=True)
    assert 300 < lim.d2d_gbps() < 20000  # HBM copy: hundreds of GB/s to a few TB/s
    assert 3 < lim.h2d_gbps() < 200 and 3 < lim.d2h_gbps() < 200  # PCIe/NVLink-C2C range
    assert lim.bidir_gbps() > 0.8 * max(lim.h2d_gbps(), lim.d2h_gbps())
