#!/usr/bin/env python3
"""Module-level import cycles between sibling modules of src/ (crate::, super::, self:: paths;
inline `mod tests` after #[cfg(test)] ignored). Usage: python3 scripts/module_cycles.py [src]; prints
nothing when there are none."""
import collections, os, re, sys
root=sys.argv[1] if len(sys.argv)>1 else 'src'
mods={}  # modpath tuple -> file
for dp,dn,fn in os.walk(root):
    for f in fn:
        if not f.endswith('.rs'): continue
        p=os.path.join(dp,f); rel=os.path.relpath(p,root)[:-3].split(os.sep)
        if rel[-1]=='mod': rel=rel[:-1]
        if rel in (['lib'],['main']): rel=[] if rel==['lib'] else ['<main>']
        mods[tuple(rel)]=p
# inline `mod x {` blocks are ignored (treated as part of file)
def strip(src):
    src=re.sub(r'//[^\n]*','',src)
    # drop #[cfg(test)] mod tests { ... } roughly: cut from '#[cfg(test)]\nmod' to end
    m=re.search(r'#\[cfg\(test\)\]\s*(pub\s+)?mod\s+\w+\s*\{',src)
    if m: src=src[:m.start()]
    return src
def resolve(cur,path):
    parts=path.split('::')
    if parts[0]=='crate': base=[]; parts=parts[1:]
    elif parts[0]=='super':
        base=list(cur)
        while parts and parts[0]=='super': base=base[:-1]; parts=parts[1:]
    elif parts[0]=='self': base=list(cur); parts=parts[1:]
    else: return None
    full=base+parts
    best=None
    for i in range(len(full),-1,-1):
        if tuple(full[:i]) in mods: best=tuple(full[:i]); break
    return best
edges={}
for m,p in mods.items():
    src=strip(open(p).read())
    refs=set()
    # expand use groups roughly: crate::a::{b, c::d}
    for mm in re.finditer(r'\b((?:crate|super|self)(?:::\w+)+)(::\{([^}]*)\})?',src):
        head=mm.group(1)
        if mm.group(3):
            for item in mm.group(3).split(','):
                item=item.strip().split(' ')[0].split('::{')[0]
                if item: refs.add(head+'::'+item)
        refs.add(head)
    for r in refs:
        t=resolve(m,r)
        if t is not None and t!=m: edges.setdefault(m,set()).add(t)
# sibling graph: for each pair of modules with common parent, edge child_a->child_b if any module under a refs under b
def topchild(parent,m):
    if len(m)>len(parent) and m[:len(parent)]==parent: return m[:len(parent)+1]
    return None
parents=set(m[:-1] for m in mods if m)
found=0

for parent in sorted(parents):
    g=collections.defaultdict(set); why=collections.defaultdict(list)
    for a,ts in edges.items():
        ca=topchild(parent,a)
        if not ca: continue
        for t in ts:
            cb=topchild(parent,t)
            if cb and cb!=ca: g[ca].add(cb); why[(ca,cb)].append(('::'.join(a),'::'.join(t)))
    # tarjan
    idx={};low={};st=[];on=set();sccs=[];c=[0]
    def sc(v):
        idx[v]=low[v]=c[0];c[0]+=1;st.append(v);on.add(v)
        for w in g[v]:
            if w not in idx: sc(w);low[v]=min(low[v],low[w])
            elif w in on: low[v]=min(low[v],idx[w])
        if low[v]==idx[v]:
            s=[]
            while True:
                w=st.pop();on.discard(w);s.append(w)
                if w==v:break
            if len(s)>1: sccs.append(s)
    for v in list(g):
        if v not in idx: sc(v)
    found+=len(sccs)
    for s in sccs:
        names=sorted('::'.join(x) for x in s)
        print('CYCLE under',('::'.join(parent) or 'crate'),':',names)
        for a in s:
            for b in s:
                if (a,b) in why: print('   ','::'.join(a),'->','::'.join(b),':',sorted(set(why[(a,b)]))[:6])
sys.exit(1 if found else 0)
