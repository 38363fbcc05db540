import sys,time,os,torch,cProfile,pstats,torch.nn as nn,torch.nn.functional as F
from torch._inductor.compile_fx import compile_fx as cf
from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as BS
M=sys.argv[1].rstrip('2');D=3072;H=24;h=128;I,J=1024,256;P='/tmp/a.bin'
L=nn.Linear
def mlp():return nn.Sequential(L(D,4*D),nn.GELU('tanh'),L(4*D,D))
def ro(x,c,s):a,b=x.unflatten(-1,(-1,2)).unbind(-1);return torch.stack([a*c-b*s,a*s+b*c],-1).flatten(-2)
class B(nn.Module):
 def __init__(s):
  super().__init__();s.mo=L(D,12*D);s.qi=L(D,3*D);s.qt=L(D,3*D);s.oi=L(D,D);s.ot=L(D,D)
  s.mi=mlp();s.mt=mlp();s.n=nn.LayerNorm(D,elementwise_affine=False);s.qn=nn.RMSNorm(h);s.kn=nn.RMSNorm(h)
 def forward(s,x,t,v,c,sn):
  m=s.mo(F.silu(v)).chunk(12,-1);n=s.n
  q,k,u=torch.cat([s.qt(n(t)*(1+m[7])+m[6]),s.qi(n(x)*(1+m[1])+m[0])],1).view(1,I+J,3,H,h).permute(2,0,3,1,4)
  a=F.scaled_dot_product_attention(ro(s.qn(q),c,sn),ro(s.kn(k),c,sn),u).transpose(1,2).reshape(1,I+J,D)
  x=x+m[2]*s.oi(a[:,J:]);x=x+m[5]*s.mi(n(x)*(1+m[4])+m[3])
  t=t+m[8]*s.ot(a[:,:J]);return x,t+m[11]*s.mt(n(t)*(1+m[10])+m[9])
def be(g,e):
 with torch._functorch.config.patch(activation_memory_budget=.5,force_non_lazy_backward_lowering=True):return cf(g,e)
torch.manual_seed(0);b1=B().cuda().bfloat16();b2=B().cuda().bfloat16()
r=lambda *s:torch.randn(*s,device='cuda',dtype=torch.bfloat16)
X=[r(1,I,D).requires_grad_(),r(1,J,D),r(1,1,D),r(1,1,I+J,64),r(1,1,I+J,64)]
def st(f,b):b.zero_grad();o=f(b,*X);(o[0].float().sum()+o[1].float().sum()).backward();torch.cuda.synchronize();return o
def T(n,f):t=time.perf_counter();r=f();print(M,n,'%.3f s'%(time.perf_counter()-t),flush=True);return r
def pr(n,f):
 p=cProfile.Profile();r=p.runcall(T,n,f);pstats.Stats(p).sort_stats('cumulative').print_stats(70);return r
if M in('cold','warm'):
 f=torch.compile(B.forward,backend=be,fullgraph=True);pr('first',lambda:st(f,b1));T('inst2',lambda:st(f,b2))
 print(torch._dynamo.utils.compile_times())
elif M=='save':
 torch._dynamo.config.enable_aot_compile=True;f=torch.compile(B.forward,backend=lambda g,e:BS(be(g,e)),fullgraph=True)
 a=T('aot_compile',lambda:f.aot_compile(((b1,*X),{})));T('save',lambda:a.save_compiled_function(P));print('size',os.path.getsize(P))
else:
 a=pr('load',lambda:torch.compiler.load_compiled_function(open(P,'rb')))
 T('call1',lambda:st(a,b1));o=T('call2',lambda:st(a,b2));g=[p.grad.clone() for p in b2.parameters()]
 e=st(B.forward,b2);print('maxdiff',(o[0]-e[0]).abs().max().item(),max(((x-p.grad).abs().max()/p.grad.abs().max()).item() for x,p in zip(g,b2.parameters())))
