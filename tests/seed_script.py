# The reproducer from the torchdata issue, changed only as a user of mprs_plus would:
# the reading service is imported from mprs_plus, and the Wrapper's extra reference
# to its source is wrapped in NoGraph(...).
import os
import functools
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe
from torchdata.datapipes import functional_datapipe
from torchdata.dataloader2 import DataLoader2
from mprs_plus import MultiProcessingReadingService, NoGraph
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

@functional_datapipe('non_replicable')
class NonReplicableIterDataPipe(IterDataPipe):
    def __init__(self, dp):
        self.dp = dp

    def __iter__(self):
        return iter(self.dp)

    def is_replicable(self):
        return False

def init_fn(datapipe, worker_info):
    print('Hello from init_fn: ', os.getpid(), flush=True)
    return datapipe

def test(x, prefix=''):
    print(prefix, ' ', x, ' ', os.getpid(), flush=True)
    return x

def create_pipe(src):
    pipe = src
    pipe = pipe.map(functools.partial(test, prefix='Pre Main'))
    pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    pipe = pipe.map(functools.partial(test, prefix='Worker'))
    pipe = pipe.non_replicable()
    pipe = pipe.map(functools.partial(test, prefix='Post Main'))
    return pipe

class Wrapper(IterDataPipe):

    def __init__(self):
        self.src = NoGraph(IterableWrapper(range(4)))
        self.dp = create_pipe(self.src)

    def __iter__(self):
        return iter(self.dp)

def main():
    print('Main Process: ', os.getpid(), flush=True)
    pipe = create_pipe(IterableWrapper(range(4)))

    rs = MultiProcessingReadingService(2, worker_init_fn=init_fn, worker_prefetch_cnt=0, main_prefetch_cnt=0)
    loader = DataLoader2(pipe, reading_service=rs)
    [_ for _ in loader]

    print('-------------------------------------')

    rs = MultiProcessingReadingService(2, worker_init_fn=init_fn, worker_prefetch_cnt=0, main_prefetch_cnt=0)
    loader = DataLoader2(Wrapper(), reading_service=rs)
    [_ for _ in loader]

if __name__ == '__main__':
    main()
