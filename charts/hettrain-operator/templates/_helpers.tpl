{{/* Chart name. */}}
{{- define "hettrain-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name (release-prefixed, 63 chars max). */}}
{{- define "hettrain-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart name and version for the helm.sh/chart label. */}}
{{- define "hettrain-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels. */}}
{{- define "hettrain-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hettrain-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Common labels. */}}
{{- define "hettrain-operator.labels" -}}
helm.sh/chart: {{ include "hettrain-operator.chart" . }}
{{ include "hettrain-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hettrain
{{- end }}

{{/* ServiceAccount name. */}}
{{- define "hettrain-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hettrain-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Operator image reference (digest wins over tag). */}}
{{- define "hettrain-operator.image" -}}
{{- $repo := printf "%s/%s" .Values.image.registry .Values.image.repository }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repo .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Namespaces the operator watches (namespaced mode) or the release namespace. */}}
{{- define "hettrain-operator.watchNamespaces" -}}
{{- default (list .Release.Namespace) .Values.operator.watchNamespaces | join "," }}
{{- end }}

{{/* The RBAC rules for namespaced resources (shared by ClusterRole and Role). */}}
{{- define "hettrain-operator.namespacedRules" -}}
- apiGroups: ["hettrain.dev"]
  resources: ["hettrainingjobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["hettrain.dev"]
  resources: ["hettrainingjobs/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "delete"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
# spec.checkpoint.pvc: a missing PVC fails the job fast (Secrets stay unreadable: a missing
# spec.checkpoint.secretRef is seen in the pods' CreateContainerConfigError instead)
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]
{{- end }}

{{/* Non-empty when operator.topology has links or devices (the topology ConfigMap is rendered). */}}
{{- define "hettrain-operator.hasTopology" -}}
{{- with .Values.operator.topology -}}
{{- if or .links .devices }}true{{ end -}}
{{- end -}}
{{- end }}
